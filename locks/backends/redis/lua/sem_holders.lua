-- sem_holders.lua: the live slots of a semaphore, for inspection (never the owner tokens).
-- KEYS[1] slots zset (owner -> lease end, server ms)  KEYS[2] holders hash
-- Returns a flat list: holder text ("fence\nhost\npid\ntask id\ntask name"), ms left, ...
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now_ms, '+inf', 'WITHSCORES')
for i = 1, #live, 2 do
  out[#out + 1] = redis.call('HGET', KEYS[2], live[i]) or '0'
  out[#out + 1] = tonumber(live[i + 1]) - now_ms
end
return out
