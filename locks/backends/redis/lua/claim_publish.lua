-- claim_publish.lua: remember the task id first published for a job key.
-- KEYS[1] queued marker
-- ARGV[1] task id  ARGV[2] marker ttl ms
-- Returns the task id already queued or running for the key, or false if this one is first.
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then
  return held
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
