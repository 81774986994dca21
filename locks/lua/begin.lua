-- begin.lua: acquire a lock with a fresh fencing token, unless the job record says DONE.
-- KEYS[1] lock hash   KEYS[2] fence counter   KEYS[3] job record hash
-- ARGV[1] owner token  ARGV[2] ttl ms  ARGV[3] fence retention ms
-- ARGV[4] host  ARGV[5] pid  ARGV[6] task id  ARGV[7] task name
-- ARGV[8] '1' to consult and write the job record, '0' for a plain lock
-- ARGV[9] argument fingerprint (written into the RUNNING record)
-- Returns {1, fence}                     granted; fence is a decimal string
--         {0, pttl, task_id}             held by another owner; pttl ms left (-1: no expiry)
--         {2, state, fingerprint, result, fence, finished_ms}   the job is already DONE
-- The fence is max(last + 1, server time in microseconds), so it keeps increasing
-- even after the server lost every key, unless its clock steps back.
redis.replicate_commands()
if ARGV[8] == '1' then
  local rec = redis.call('HMGET', KEYS[3], 'state', 'fingerprint', 'result', 'fence', 'finished_ms')
  if rec[1] == 'DONE' then
    return {2, rec[1], rec[2] or '', rec[3] or '', rec[4] or '0', rec[5] or '0'}
  end
end
local pttl = redis.call('PTTL', KEYS[1])
if pttl ~= -2 then
  return {0, pttl, redis.call('HGET', KEYS[1], 'task_id') or ''}
end
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
local fence = string.format('%.0f', math.max(last + 1, now_us))
local now_ms = string.format('%.0f', math.floor(now_us / 1000))
redis.call('SET', KEYS[2], fence, 'PX', ARGV[3])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'fence', fence, 'host', ARGV[4], 'pid', ARGV[5],
  'task_id', ARGV[6], 'task_name', ARGV[7], 'acquired_ms', now_ms, 'heartbeat_ms', now_ms)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if ARGV[8] == '1' then
  redis.call('DEL', KEYS[3])
  redis.call('HSET', KEYS[3], 'state', 'RUNNING', 'fence', fence, 'fingerprint', ARGV[9])
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
end
return {1, fence}
