-- begin.lua: acquire a lock with a fresh fencing token, unless the job record says DONE.
-- KEYS[1] lock hash   KEYS[2] fence source: one key per server (per slot on a cluster)
-- KEYS[3] job record (only with ARGV[3] '1')
-- ARGV[1] owner token  ARGV[2] ttl ms
-- ARGV[3] '1' to consult and write the job record, '0' for a plain lock
-- ARGV[4] task id  ARGV[5] holder: "host\npid\ntask name\nprocess start"
-- ARGV[6] argument fingerprint of the job (job grants only; kept in the lock hash)
-- ARGV[7] fence floor: the highest fence this client has seen from this server ('0': none)
-- Returns fence                          granted: the new fence, a decimal string
--         {0, pttl, task_id, fingerprint}   held by another owner; pttl ms left (-1: none)
--         {2, record}                       the job is already DONE (the record string of
--                                           commit.lua, parsed by the client)
--         {2, state, fingerprint, result, fence, finished_ms}   the same, from a record
--                                           hash an earlier version wrote
-- A refusal marks the lock 'waiters', so its release wakes whoever waits on the signal list
-- (the mark is made before the caller can start waiting, so no release is missed).
-- The fence is max(source + 1, server time in microseconds, floor + 1), and the source
-- keeps the highest fence this server (slot) has granted, on any key: fences rise per key
-- while the source lives; when it is lost (flush, restart empty, failover) the server clock
-- is above every earlier fence; if its clock also stepped back, the floor still keeps it
-- above every fence this client has seen (other clients' lower fences are refused by the
-- fence guards of resources that saw a higher one).
redis.replicate_commands()
local job = ARGV[3] == '1'
local rec
if job then
  local ok, raw = pcall(redis.call, 'GET', KEYS[3])
  if not ok then  -- WRONGTYPE: a record hash written by an earlier version
    local h = redis.call('HMGET', KEYS[3], 'state', 'fingerprint', 'result', 'fence',
      'finished_ms')
    if h[1] == 'DONE' then
      return {2, h[1], h[2] or '', h[3] or '', h[4] or '0', h[5] or '0'}
    end
    rec = h[1] or 'hash'
  elseif raw then
    if string.byte(raw, 1) == 68 then  -- 'D': DONE
      return {2, raw}
    end
    rec = raw
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
-- Write the server time and read the source in one command; in the rare case the source
-- is not below it (clock stepped back, or two grants in one microsecond), write source + 1
-- over it. Redis < 6.2 has no SET ... GET: read, then write.
local ok, last = pcall(redis.call, 'SET', KEYS[2], fence, 'GET')
if not ok then
  last = redis.call('GET', KEYS[2])
  redis.call('SET', KEYS[2], fence)
end
if last and tonumber(last) >= tonumber(t[1]) * 1000000 + tonumber(t[2]) then
  fence = string.format('%.0f', tonumber(last) + 1)
  redis.call('SET', KEYS[2], fence)
end
if ARGV[7] and tonumber(ARGV[7]) >= tonumber(fence) then
  fence = string.format('%.0f', tonumber(ARGV[7]) + 1)
  redis.call('SET', KEYS[2], fence)
end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'fence', fence, 'task_id', ARGV[4],
  'holder', ARGV[5], 'acquired_ms', t[1] .. string.sub(us, 1, 3), 'fingerprint', ARGV[6] or '')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
-- A running job needs no record of its own: the lock hash says who runs it, under which
-- fence. A FAILED record from an earlier run goes, so the record only ever shows a result.
if rec then
  redis.call('DEL', KEYS[3])
end
return fence
