-- custody_keep.lua: record the broker delivery tags one worker holds, until a deadline.
-- KEYS[1] custody hash (field: worker id; value: deadline in ms on the server's clock, then
--         the tags, space-separated)
-- ARGV[1] worker id  ARGV[2] lifetime ms  ARGV[3] the tags, space-separated ('' for none)
-- Returns the deadline (ms). The server's clock alone decides when a custody has lapsed.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local deadline = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], deadline .. ' ' .. ARGV[3])
return deadline
