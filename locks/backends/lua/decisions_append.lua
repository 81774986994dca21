-- The decision log's batch (locks/decisions.py): every decision XADDed to its key's capped
-- stream, each stream's TTL renewed, each (key, task id) pair XADDed to the capped index.
-- One script call for a batch of deliveries: one command to pack and one reply to read.
-- KEYS[1]: the index stream; KEYS[2..]: the job keys' decision streams.
-- ARGV: per_key, total, ttl_ms, n (decisions), then per decision: its stream's place in
-- KEYS (2..), its field count m, m field names and values alternating; then the index's
-- (key, task id) pairs to the end.
local per_key, total, ttl = ARGV[1], ARGV[2], ARGV[3]
local n = tonumber(ARGV[4])
local i = 5
for _ = 1, n do
  local stream, m = KEYS[tonumber(ARGV[i])], tonumber(ARGV[i + 1])
  redis.call('XADD', stream, 'MAXLEN', per_key, '*', unpack(ARGV, i + 2, i + 1 + m))
  i = i + 2 + m
end
for s = 2, #KEYS do
  redis.call('PEXPIRE', KEYS[s], ttl)
end
while i <= #ARGV do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', total, '*', 'k', ARGV[i], 't', ARGV[i + 1])
  i = i + 2
end
redis.call('PEXPIRE', KEYS[1], ttl)
return n
