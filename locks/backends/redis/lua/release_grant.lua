-- release_grant.lua: the admin's release of one grant, checked by its fence in the same step.
-- KEYS[1] lock hash  KEYS[2] signal list
-- ARGV[1] fence of the grant judged (decimal)  ARGV[2] signal lifetime ms
-- ARGV[3] the eviction channel  ARGV[4] the job's key (the notice: "<fence> <key>", so the
-- evicted holder's keeper looks at once: locks/backends/redis/evictions.py)
-- Returns 1 if that grant was removed, 0 if the key is free or held under another fence.
-- Fences are unique per grant, so the fence stands for the owner the admin never sees.
if redis.call('HGET', KEYS[1], 'fence') ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('RPUSH', KEYS[2], '1')
redis.call('LTRIM', KEYS[2], -1, -1)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
-- A notice only: an ACL user without the channel still evicts (its keepers find out later).
pcall(redis.call, 'PUBLISH', ARGV[3], ARGV[1] .. ' ' .. ARGV[4])
return 1
