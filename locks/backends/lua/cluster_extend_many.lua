#!lua flags=allow-cross-slot-keys
-- cluster_extend_many.lua: owner-checked extension of the locks one cluster node serves, in
-- one round trip although they sit in many slots (Redis >= 7.0: the flag above).
-- KEYS none: a cluster routes a command by its declared keys, and declared keys must share
-- one slot; the caller sends this to the node that serves every lock named below.
-- ARGV[3i-2] lock hash i  ARGV[3i-1] owner token of lock i  ARGV[3i] new ttl ms of lock i
-- Returns a list with, for each lock, 1 if extended, 0 if not ours (that one unchanged), -1
-- if this node does not serve its slot (moved away: the caller asks the cluster again).
-- A key that is no lock hash any more (overwritten with another type) is not ours.
local t = redis.call('TIME')
local now_ms = t[1] .. string.sub(string.format('%06d', t[2]), 1, 3)
local out = {}
for i = 1, #ARGV / 3 do
  local key = ARGV[3 * i - 2]
  local ok, owner = pcall(redis.call, 'HGET', key, 'owner')
  if ok and owner == ARGV[3 * i - 1] then
    redis.call('HSET', key, 'heartbeat_ms', now_ms)
    redis.call('PEXPIRE', key, ARGV[3 * i])
    out[i] = 1
  elseif ok then
    out[i] = 0
  else
    local err = type(owner) == 'table' and owner.err or tostring(owner)
    out[i] = string.find(err, 'WRONGTYPE', 1, true) and 0 or -1
  end
end
return out
