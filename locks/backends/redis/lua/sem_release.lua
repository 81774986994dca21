-- sem_release.lua: free an owner's semaphore slot and drop its place in the queue.
-- KEYS[1] slots zset  KEYS[2] queue zset  KEYS[3] queue expiry zset  KEYS[4] holders hash
-- ARGV[1] owner token
-- Returns 1 if a live slot was freed, 0 if the owner held none (lapsed, or only queued).
redis.replicate_commands()
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ends = redis.call('ZSCORE', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
if ends and tonumber(ends) > now_ms then
  return 1
end
return 0
