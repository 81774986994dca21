-- begin.lua: acquire a lock with a fresh fencing token, unless the job record says DONE.
-- KEYS[1] lock hash   KEYS[2] fence counter   KEYS[3] job record hash (only with ARGV[4] '1')
-- ARGV[1] owner token  ARGV[2] ttl ms  ARGV[3] fence retention ms
-- ARGV[4] '1' to consult and write the job record, '0' for a plain lock
-- ARGV[5] task id  ARGV[6] holder: "host\npid\ntask name\nprocess start"
-- ARGV[7] argument fingerprint of the job (job grants only; kept in the lock hash)
-- ARGV[8] fence floor: the highest fence this client has seen from this server ('0': none)
-- Returns fence                          granted: the new fence, a decimal string
--         {0, pttl, task_id, fingerprint}   held by another owner; pttl ms left (-1: none)
--         {2, state, fingerprint, result, fence, finished_ms}   the job is already DONE
-- A refusal marks the lock 'waiters', so its release wakes whoever waits on the signal list
-- (the mark is made before the caller can start waiting, so no release is missed).
-- The fence is max(last + 1, server time in microseconds, floor + 1), so it keeps
-- increasing even after the server lost every key; if its clock also stepped back, the
-- floor still keeps it above every fence this client has seen (other clients' lower fences
-- are refused by the fence guards of resources that saw a higher one).
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
-- Decimal strings built from TIME's fields: exact, and cheaper than formatting a float.
local us = string.format('%06d', t[2])
local fence = t[1] .. us
-- Write the server time and read the last fence in one command; in the rare case the
-- last fence is not below it (clock stepped back, or two grants in one microsecond),
-- write last + 1 over it. Redis < 6.2 has no SET ... GET: read, then write.
local ok, last = pcall(redis.call, 'SET', KEYS[2], fence, 'PX', ARGV[3], 'GET')
if not ok then
  last = redis.call('GET', KEYS[2])
  redis.call('SET', KEYS[2], fence, 'PX', ARGV[3])
end
if last and tonumber(last) >= tonumber(t[1]) * 1000000 + tonumber(t[2]) then
  fence = string.format('%.0f', tonumber(last) + 1)
  redis.call('SET', KEYS[2], fence, 'PX', ARGV[3])
end
if ARGV[8] and tonumber(ARGV[8]) >= tonumber(fence) then
  fence = string.format('%.0f', tonumber(ARGV[8]) + 1)
  redis.call('SET', KEYS[2], fence, 'PX', ARGV[3])
end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'fence', fence, 'task_id', ARGV[5],
  'holder', ARGV[6], 'acquired_ms', t[1] .. string.sub(us, 1, 3), 'fingerprint', ARGV[7] or '')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
-- A running job needs no record of its own: the lock hash says who runs it, under which
-- fence. A FAILED record from an earlier run goes, so the record only ever shows a result.
if job and rec[1] then
  redis.call('DEL', KEYS[3])
end
return fence
