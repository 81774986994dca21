#!lua flags=allow-cross-slot-keys
-- cluster_extend_many.lua: owner-checked extension of the locks and semaphore slots one
-- cluster node serves, in one round trip although they sit in many slots (Redis >= 7.0: the
-- flag above).
-- KEYS none: a cluster routes a command by its declared keys, and declared keys must share
-- one slot; the caller sends this to the node that serves every key named below.
-- ARGV[1] retention ms of a semaphore's keys, then one record per lease, in order:
--   'L', lock hash, owner token, new ttl ms                                  (a lock)
--   'S', slots, queue, queue expiry, state, holders, owner token, new ttl ms  (a slot;
--        the five keys of sem_acquire.lua)
-- Returns a list with, for each lease, 1 if extended, 0 if not ours (that one unchanged), -1
-- if this node does not serve its slot (moved away: the caller asks the cluster again).
-- A key of another type (overwritten) is not ours. A lapsed slot is never revived (its place
-- may have gone to a waiter); an extended one pushes its semaphore's keys' expiry out.
local t = redis.call('TIME')
local now_text = t[1] .. string.sub(string.format('%06d', t[2]), 1, 3)
local now_ms = tonumber(now_text)
local retention = tonumber(ARGV[1])
local function refused(err)
  err = type(err) == 'table' and err.err or tostring(err)
  return string.find(err, 'WRONGTYPE', 1, true) and 0 or -1
end
local out = {}
local i = 2
while i <= #ARGV do
  if ARGV[i] == 'L' then
    local key, owner, ttl = ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
    local ok, held = pcall(redis.call, 'HGET', key, 'owner')
    if ok and held == owner then
      redis.call('HSET', key, 'heartbeat_ms', now_text)
      redis.call('PEXPIRE', key, ttl)
      out[#out + 1] = 1
    elseif ok then
      out[#out + 1] = 0
    else
      out[#out + 1] = refused(held)
    end
    i = i + 4
  else
    local slots, owner, ttl = ARGV[i + 1], ARGV[i + 6], tonumber(ARGV[i + 7])
    local ok, ends = pcall(redis.call, 'ZSCORE', slots, owner)
    if ok and ends and tonumber(ends) > now_ms then
      redis.call('ZADD', slots, 'XX', now_ms + ttl, owner)
      local keep = math.max(retention, ttl)
      for k = i + 1, i + 5 do
        redis.call('PEXPIRE', ARGV[k], keep)
      end
      out[#out + 1] = 1
    elseif ok then
      out[#out + 1] = 0
    else
      out[#out + 1] = refused(ends)
    end
    i = i + 8
  end
end
return out
