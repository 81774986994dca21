-- redlock_begin.lua: phase one of a Redlock grant on one master (locks/backends/redlock.py).
-- KEYS[1] lock hash   KEYS[2] fence counter   KEYS[3] job record hash (only with ARGV[4] '1')
-- ARGV[1] owner token  ARGV[2] ttl ms  ARGV[3] fence retention ms
-- ARGV[4] '1' to consult the job record, '0' for a plain lock
-- ARGV[5] task id  ARGV[6] holder: "host\npid\ntask name\nprocess start"  ARGV[7] fingerprint
-- ARGV[8] the client's proposed fence, a decimal string ('0': none, two phases wanted)
-- Returns {1, value, accepted}   locked here. value is max(stored fence, server time in µs);
--                                 if the proposal is above it, the proposal is written as this
--                                 master's fence (the lock carries it) and accepted is 1
--         {0, pttl, task_id, fingerprint}   held by another owner; pttl ms left (-1: none)
--         {2, state, fingerprint, result, fence, finished_ms}   the job is DONE here
-- A refusal marks the lock 'waiters', so its release pushes the signal list a waiter blocks on.
-- The server-time floor keeps values moving on a master that lost its data. Writing the
-- proposal is phase two (redlock_fence.lua) done at once: it happens only under our own
-- lock and only over a lower stored fence, and the client counts it only from a majority.
redis.replicate_commands()
local job = ARGV[4] == '1'
local rec
if job then
  rec = redis.call('HMGET', KEYS[3], 'state', 'fingerprint', 'result', 'fence', 'finished_ms')
  if rec[1] == 'DONE' then
    return {2, rec[1], rec[2] or '', rec[3] or '', rec[4] or '0', rec[5] or '0'}
  end
end
local pttl = redis.call('PTTL', KEYS[1])
if pttl ~= -2 then
  redis.call('HSET', KEYS[1], 'waiters', '1')
  local held = redis.call('HMGET', KEYS[1], 'task_id', 'fingerprint')
  return {0, pttl, held[1] or '', held[2] or ''}
end
local t = redis.call('TIME')
local us = string.format('%06d', t[2])
local value = t[1] .. us
local last = redis.call('GET', KEYS[2])
if last and tonumber(last) > tonumber(value) then
  value = last
end
local accepted = 0
local proposal = ARGV[8]
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'task_id', ARGV[5], 'holder', ARGV[6],
  'acquired_ms', t[1] .. string.sub(us, 1, 3), 'fingerprint', ARGV[7] or '')
if proposal ~= '0' and tonumber(proposal) > tonumber(value) then
  redis.call('SET', KEYS[2], proposal, 'PX', ARGV[3])
  redis.call('HSET', KEYS[1], 'fence', proposal)
  value = proposal
  accepted = 1
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if job and rec[1] then
  redis.call('DEL', KEYS[3])
end
return {1, value, accepted}
