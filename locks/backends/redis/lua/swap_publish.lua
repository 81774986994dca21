-- swap_publish.lua: compare-and-set of a job key's publish claim.
-- KEYS[1] queued marker
-- ARGV[1] expected value  ARGV[2] new value ('' removes the claim)  ARGV[3] ttl ms
-- Returns false if the claim now holds ARGV[2] (it was absent, ARGV[1] or ARGV[2]), else
-- the other value that kept it (left alone).
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] and held ~= ARGV[2] then
  return held
end
if ARGV[2] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return false
