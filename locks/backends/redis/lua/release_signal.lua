-- release_signal.lua: a fragment, not a script: the scripts that end a holder's lock start
-- with `-- include: release_signal` and get this function in its place (scripts.py).
-- It deletes the lock hash and, if a refused attempt marked it 'waiters' (see begin.lua),
-- pushes one wake-up to the signal list, which lasts `signal_ttl_ms`.
local function release_and_signal(lock, signal, waiters, signal_ttl_ms)
  redis.call('DEL', lock)
  if waiters then
    redis.call('RPUSH', signal, '1')
    redis.call('LTRIM', signal, -1, -1)
    redis.call('PEXPIRE', signal, signal_ttl_ms)
  end
end
