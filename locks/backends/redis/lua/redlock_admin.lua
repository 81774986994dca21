-- redlock_admin.lua: the small writes Redlock sends to every master outside a grant.
-- KEYS[1] the key acted on  KEYS[2] signal list (ops 'unlock' and 'judged' only)
-- ARGV[1] op: 'count'  increment a delivery counter, ARGV[2] its lifetime ms; returns the count
--             'unlock' remove a lock whatever its owner and wake waiters, ARGV[2] signal
--                      lifetime ms; returns 1 if there was a lock
--             'judged' like 'unlock', only while the lock carries fence ARGV[3] (the grant
--                      an operator judged); returns 1 if it did and was removed
--             'delete' remove the key; returns 1 if it existed
local op = ARGV[1]
if op == 'count' then
  local n = redis.call('INCR', KEYS[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return n
end
if op == 'judged' and redis.call('HGET', KEYS[1], 'fence') ~= ARGV[3] then
  return 0
end
if op == 'unlock' or op == 'judged' then
  local n = redis.call('DEL', KEYS[1])
  redis.call('RPUSH', KEYS[2], '1')
  redis.call('LTRIM', KEYS[2], -1, -1)
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return n
end
if op == 'delete' then
  return redis.call('DEL', KEYS[1])
end
return redis.error_reply('unknown op ' .. tostring(op))
