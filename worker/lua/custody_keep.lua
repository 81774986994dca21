-- custody_keep.lua: record the broker delivery tags one worker holds, each until its deadline.
-- KEYS[1] custody hash (field: worker id; value: the record's deadline in ms on the server's
--         clock, then one 'tag=deadline_ms' per tag, space-separated)
-- ARGV[1] worker id  ARGV[2] the record's lifetime ms  ARGV[3] 'tag=lifetime_ms' per tag held,
--         space-separated ('' for none): a delivery's lifetime is its task's lease TTL
-- Returns the record's deadline (ms): its own lifetime or its longest tag's, whichever is later.
-- The server's clock alone decides when a custody has lapsed.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local deadline = now + tonumber(ARGV[2])
local tags = {}
for tag, ms in string.gmatch(ARGV[3], '([^%s=]+)=(%d+)') do
  local until_ms = now + tonumber(ms)
  if until_ms > deadline then
    deadline = until_ms
  end
  tags[#tags + 1] = tag .. '=' .. until_ms
end
redis.call('HSET', KEYS[1], ARGV[1], deadline .. ' ' .. table.concat(tags, ' '))
return deadline
