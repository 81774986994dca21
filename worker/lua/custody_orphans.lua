-- custody_orphans.lua: the unacked deliveries that no live worker holds in custody.
-- KEYS[1] custody hash (see custody_keep.lua)  KEYS[2] kombu's unacked index (zset: tag ->
--         delivery time in seconds, the consuming worker's clock)
-- ARGV[1] cutoff: only tags delivered at or before it (seconds)  ARGV[2] skip this many of
--         them (the oldest)  ARGV[3] look at most at this many
-- Returns {number of tags looked at, the orphans among them, oldest first}. Lapsed custodies
-- (their worker is gone) are removed.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local held = {}
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  local value = entries[i + 1]
  local deadline = tonumber(string.match(value, '^(%d+)'))
  if deadline == nil or deadline <= now then
    redis.call('HDEL', KEYS[1], entries[i])
  else
    for tag in string.gmatch(value, '%S+') do
      held[tag] = true
    end
  end
end
local orphans = {}
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', tonumber(ARGV[2]),
                      tonumber(ARGV[3]))
for _, tag in ipairs(old) do
  if not held[tag] then
    orphans[#orphans + 1] = tag
  end
end
return {#old, orphans}
