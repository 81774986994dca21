-- redlock_fence.lua: phase two of a Redlock grant on one master: write the grant's fence.
-- KEYS[1] lock hash  KEYS[2] fence counter  KEYS[3] signal list
-- ARGV[1] owner token  ARGV[2] the grant's fence f (decimal)  ARGV[3] fence retention ms
-- ARGV[4] signal lifetime ms
-- Returns 1 if the lock here is ours and carries f (written now, or already), else 0.
-- f is written only under our own lock and only over a lower stored fence. Where our lock
-- sits on a fence at or above f (a master that cannot carry this grant), the lock is taken
-- off instead, so every master ends either in line with the grant or without our key.
-- include: release_signal
redis.replicate_commands()
local cur = redis.call('HMGET', KEYS[1], 'owner', 'fence', 'waiters')
if cur[1] ~= ARGV[1] then
  return 0
end
if cur[2] == ARGV[2] then
  return 1
end
local last = redis.call('GET', KEYS[2])
if not last or tonumber(last) < tonumber(ARGV[2]) then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  redis.call('HSET', KEYS[1], 'fence', ARGV[2])
  return 1
end
release_and_signal(KEYS[1], KEYS[3], cur[3], ARGV[4])
return 0
