-- redlock_commit.lua: store a job's final record and release its lock on one master, if ours.
-- KEYS[1] lock hash  KEYS[2] job record hash  KEYS[3] signal list
-- ARGV[1] owner token  ARGV[2] state (DONE | FAILED)  ARGV[3] result JSON
-- ARGV[4] argument fingerprint  ARGV[5] fence  ARGV[6] record ttl ms  ARGV[7] signal lifetime ms
-- ARGV[8] finished_ms: the committing client's clock, the same on every master, so the
-- copies of one record are identical and a majority of them can be recognised
-- Returns 1 if stored and released, 0 if no longer the owner (nothing written).
-- include: release_signal
local cur = redis.call('HMGET', KEYS[1], 'owner', 'waiters')
if cur[1] ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[2], 'state', ARGV[2], 'result', ARGV[3], 'fingerprint', ARGV[4],
  'fence', ARGV[5], 'finished_ms', ARGV[8])
redis.call('PEXPIRE', KEYS[2], ARGV[6])
release_and_signal(KEYS[1], KEYS[3], cur[2], ARGV[7])
return 1
