-- custody_orphans.lua: the unacked deliveries that no live custody holds.
-- KEYS[1] custody hash (see custody_keep.lua)  KEYS[2] kombu's unacked index (zset: tag ->
--         delivery time in seconds, the consuming worker's clock)
-- ARGV[1] cutoff: only tags delivered at or before it (seconds)  ARGV[2] skip this many of
--         them (the oldest)  ARGV[3] look at most at this many
-- Returns {number of tags looked at, {tag, delivery time, tag, delivery time, ...} of the
-- orphans among them, oldest first}. A tag is held until its own deadline (its task's lease
-- TTL after its worker's last record); a bare tag (an older release's record) until its
-- record's. Lapsed records (their worker is gone) are removed.
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
    for token in string.gmatch((string.gsub(value, '^%d+', '')), '%S+') do
      local tag, until_ms = string.match(token, '^([^=]+)=(%d+)$')
      if tag == nil then
        held[token] = true
      elseif tonumber(until_ms) > now then
        held[tag] = true
      end
    end
  end
end
local orphans = {}
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'WITHSCORES', 'LIMIT',
                       tonumber(ARGV[2]), tonumber(ARGV[3]))
for i = 1, #old, 2 do
  if not held[old[i]] then
    orphans[#orphans + 1] = old[i]
    orphans[#orphans + 1] = old[i + 1]
  end
end
return {math.floor(#old / 2), orphans}
