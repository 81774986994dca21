-- The decision log's batch (locks/decisions.py): each decision worth explaining XADDed to
-- its key's capped stream, each such stream's TTL renewed, then the index's entries XADDed
-- to the capped index (a routine decision whole, the others a key and task id pointer).
-- One script call for a batch of deliveries: one command to pack and one reply to read.
-- KEYS[1]: the index stream; KEYS[2..]: the job keys' decision streams.
-- ARGV: per_key, total, ttl_ms, n (decisions for streams), then per such decision: its
-- stream's place in KEYS (2..), its field count m, m field names and values alternating;
-- then, to the end, the index's entries: each a field count m and m names and values.
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
  local m = tonumber(ARGV[i])
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', total, '*', unpack(ARGV, i + 1, i + m))
  i = i + 1 + m
end
redis.call('PEXPIRE', KEYS[1], ttl)
return n
