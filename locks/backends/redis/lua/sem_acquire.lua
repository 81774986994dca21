-- sem_acquire.lua: take a slot of a counting semaphore, or keep a place in its arrival queue.
-- KEYS[1] slots zset (owner -> lease end, server ms)   KEYS[2] queue zset (owner -> ticket)
-- KEYS[3] queue expiry zset (owner -> when its place lapses, ms)
-- KEYS[4] state hash: 'fence' (last slot fence), 'ticket' (last ticket)
-- KEYS[5] holders hash (owner -> "fence\nhost\npid\ntask id\ntask name")
-- ARGV[1] owner token  ARGV[2] limit  ARGV[3] slot ttl ms  ARGV[4] queue ms ('0': no place)
-- ARGV[5] holder text  ARGV[6] fence floor ('0': none)  ARGV[7] retention ms of the keys
-- Returns {1, fence}           granted: the new slot's fence, a decimal string
--         {0, position, ms}    refused: waiters ahead (-1: not queued), ms until the
--                              earliest slot's lease ends (0: none held)
-- Admission is in ticket order: the owner is granted only while fewer waiters are ahead of
-- it than slots are free, so a newcomer never overtakes a waiter. Lapsed slots (crashed
-- holders) and lapsed places (dead waiters) are dropped first. The fence is
-- max(last + 1, server time in microseconds, floor + 1): it keeps increasing across a
-- restart that lost every key, as the lock fences do (DESIGN §4).
redis.replicate_commands()
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local owner = ARGV[1]
local limit = tonumber(ARGV[2])
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms)) do
  redis.call('ZREM', KEYS[1], gone)
  redis.call('HDEL', KEYS[5], gone)
end
for _, lapsed in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now_ms)) do
  redis.call('ZREM', KEYS[3], lapsed)
  redis.call('ZREM', KEYS[2], lapsed)
end
if redis.call('ZSCORE', KEYS[1], owner) then  -- a repeat of a grant whose answer was lost
  local mine = redis.call('HGET', KEYS[5], owner) or '0'
  return {1, string.match(mine, '^[^\n]*')}
end
local free = limit - redis.call('ZCARD', KEYS[1])
local ahead = redis.call('ZRANK', KEYS[2], owner)
if not ahead then
  ahead = redis.call('ZCARD', KEYS[2])  -- not queued: everyone queued is ahead
end
if ahead < free then
  local fence = t[1] .. string.format('%06d', t[2])
  local last = redis.call('HGET', KEYS[4], 'fence')
  if last and tonumber(last) >= tonumber(fence) then
    fence = string.format('%.0f', tonumber(last) + 1)
  end
  if tonumber(ARGV[6]) >= tonumber(fence) then
    fence = string.format('%.0f', tonumber(ARGV[6]) + 1)
  end
  redis.call('HSET', KEYS[4], 'fence', fence)
  redis.call('ZREM', KEYS[2], owner)
  redis.call('ZREM', KEYS[3], owner)
  redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[3]), owner)
  redis.call('HSET', KEYS[5], owner, fence .. '\n' .. ARGV[5])
  local keep = math.max(tonumber(ARGV[7]), tonumber(ARGV[3]))
  for i = 1, 5 do
    redis.call('PEXPIRE', KEYS[i], keep)
  end
  return {1, fence}
end
local position = -1
if ARGV[4] ~= '0' then
  if not redis.call('ZSCORE', KEYS[2], owner) then
    redis.call('ZADD', KEYS[2], redis.call('HINCRBY', KEYS[4], 'ticket', 1), owner)
  end
  redis.call('ZADD', KEYS[3], now_ms + tonumber(ARGV[4]), owner)
  local keep = math.max(tonumber(ARGV[7]), tonumber(ARGV[4]))
  for i = 2, 4 do
    redis.call('PEXPIRE', KEYS[i], keep)
  end
  position = ahead
end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local wait = 0
if first[2] then
  wait = math.max(0, tonumber(first[2]) - now_ms)
end
return {0, position, wait}
