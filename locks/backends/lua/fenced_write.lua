-- fenced_write.lua: check-and-advance a resource's fence, then run the given writes.
-- KEYS[1] fence record of the resource  KEYS[2..n] keys the writes touch
-- ARGV[1] fencing token  ARGV[2] JSON list of commands, each a list like ["HSET", "k", "f", "v"]
-- Returns {1, fence, replies...} if the token is >= the last accepted one (writes done),
--         {0, last}             if it is lower (stale: nothing written).
-- Tokens are compared as decimal strings (shorter is smaller), not as Lua doubles,
-- which stop telling neighbours apart above 2^53.
local function less(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local last = redis.call('GET', KEYS[1])
if last and less(ARGV[1], last) then
  return {0, last}
end
redis.call('SET', KEYS[1], ARGV[1])
local out = {1, ARGV[1]}
for _, cmd in ipairs(cjson.decode(ARGV[2])) do
  local reply = redis.call(unpack(cmd))
  if type(reply) == 'table' and reply.ok then reply = reply.ok end
  out[#out + 1] = reply
end
return out
