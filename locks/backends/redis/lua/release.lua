-- release.lua: owner-checked release; wakes blocked waiters through the signal list.
-- KEYS[1] lock hash  KEYS[2] signal list
-- ARGV[1] owner token  ARGV[2] signal lifetime ms
-- Returns 1 if released, 0 if the lock is gone or belongs to another owner (nothing changed).
-- The signal is pushed only if a refused attempt marked the lock 'waiters' (see begin.lua).
-- include: release_signal
local cur = redis.call('HMGET', KEYS[1], 'owner', 'waiters')
if cur[1] ~= ARGV[1] then
  return 0
end
release_and_signal(KEYS[1], KEYS[2], cur[2], ARGV[2])
return 1
