-- fenced_write.lua: an idempotent fenced write. Check-and-advance a resource's fence, then run
-- the given commands, at most once per (fence, write id): a resend gets the first reply.
-- KEYS[1] fence record of the resource (a string: the last accepted token)
-- KEYS[2] write record of the resource (a hash: 'fence', and per write id the stored answer)
-- KEYS[3..n] keys the writes touch (declared for the server, not read here); with a job
--          record (ARGV[4] not empty) KEYS[3] is that record and the touched keys follow it
-- ARGV[1] fencing token  ARGV[2] write id  ARGV[3] JSON list of commands, e.g. [["HSET","k","f","v"]]
-- ARGV[4] '' or the job's argument fingerprint: then the job's DONE record (KEYS[3], a hash:
--         fingerprint, result, fence) is read first and written with the commands, so a
--         re-run of a finished job (granted again after the lock server lost its data, with
--         a higher fence) is answered from it and applies nothing
-- ARGV[5] the job's result (JSON) to store  ARGV[6] the record's lifetime in ms (0: kept)
-- Returns {1, fence, replies...}   applied now
--         {2, fence, replies...}   a resend of the write already applied under this fence and
--                                  write id: its stored reply; nothing applied
--         {0, last}                stale token: nothing written
--         {3, index, reason}       command `index` would fail (type, integer, arity): refused
--                                  before anything was written; the fence is unchanged
--         {4, fence}               the write id was used under this fence with other commands
--         {5, fence, index, reason, replies...}  command `index` failed in a way the check
--                                  cannot foresee, after commands 1..index-1 were applied;
--                                  stored like a reply, so a resend answers the same
--         {6, fence, result}       the job's DONE record was there (the job took effect under
--                                  `fence`): its stored result; nothing applied
--         {7, fence}               the record holds another fingerprint: nothing applied
-- Tokens are compared as decimal strings (shorter is smaller), not as Lua doubles,
-- which stop telling neighbours apart above 2^53.
local function less(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end

local fence, wid, body = ARGV[1], 'w:' .. ARGV[2], ARGV[3]
local job = ARGV[4] ~= nil and ARGV[4] ~= ''
if job then
  local done = redis.call('HMGET', KEYS[3], 'fingerprint', 'result', 'fence')
  if done[1] then
    if done[1] ~= ARGV[4] then return {7, done[3]} end
    return {6, done[3], done[2]}
  end
end
local last = redis.call('GET', KEYS[1])
if last and less(fence, last) then
  return {0, last}
end
local digest = redis.sha1hex(body)
local current = last == fence and redis.call('HGET', KEYS[2], 'fence') == fence
if current then
  local stored = redis.call('HGET', KEYS[2], wid)
  if stored then
    local answer = cmsgpack.unpack(stored)
    if answer[1] ~= digest then
      return {4, fence}
    end
    answer[1] = answer[2] == 1 and 2 or answer[2]
    answer[2] = fence
    return answer
  end
end
local commands = cjson.decode(body)

-- First pass, read only: refuse a write whose known commands would fail on the data as it
-- is (or as the commands before them leave it), so a refused write applies nothing.
-- t: the type the key must have if it exists ('' any); a: arity (negative: at least);
-- ints/nums: argument positions that must be integers/numbers; incr: the current value must
-- be an integer ('s' string, 'h' hash field) or a number ('sf', 'hf'); pairs: field/value
-- pairs from position 3; r: a read (the key keeps its type); opt: options may follow (then
-- the command is not checked); make: the type the key has afterwards (default t; none: deleted).
-- Commands outside the table, or with options the table does not model, are not checked.
local SPEC = {
  SET = {t = '', a = 3, opt = 1, make = 'string'}, SETNX = {t = '', a = 3, make = 'string'},
  SETEX = {t = '', a = 4, ints = {3}, make = 'string'},
  PSETEX = {t = '', a = 4, ints = {3}, make = 'string'},
  GET = {r = 1, t = 'string', a = 2}, GETSET = {t = 'string', a = 3}, APPEND = {t = 'string', a = 3},
  INCR = {t = 'string', a = 2, incr = 's'}, DECR = {t = 'string', a = 2, incr = 's'},
  INCRBY = {t = 'string', a = 3, ints = {3}, incr = 's'},
  DECRBY = {t = 'string', a = 3, ints = {3}, incr = 's'},
  INCRBYFLOAT = {t = 'string', a = 3, nums = {3}, incr = 'sf'},
  HSET = {t = 'hash', a = -4, pairs = true}, HMSET = {t = 'hash', a = -4, pairs = true},
  HSETNX = {t = 'hash', a = 4}, HDEL = {t = 'hash', a = -3}, HGET = {r = 1, t = 'hash', a = 3},
  HGETALL = {r = 1, t = 'hash', a = 2},
  HINCRBY = {t = 'hash', a = 4, ints = {4}, incr = 'h'},
  HINCRBYFLOAT = {t = 'hash', a = 4, nums = {4}, incr = 'hf'},
  LPUSH = {t = 'list', a = -3}, RPUSH = {t = 'list', a = -3}, LLEN = {r = 1, t = 'list', a = 2},
  LRANGE = {r = 1, t = 'list', a = 4, ints = {3, 4}}, LTRIM = {t = 'list', a = 4, ints = {3, 4}},
  LREM = {t = 'list', a = 4, ints = {3}},
  SADD = {t = 'set', a = -3}, SREM = {t = 'set', a = -3}, SCARD = {r = 1, t = 'set', a = 2},
  SISMEMBER = {r = 1, t = 'set', a = 3}, SMEMBERS = {r = 1, t = 'set', a = 2},
  ZINCRBY = {t = 'zset', a = 4, nums = {3}}, ZREM = {t = 'zset', a = -3},
  ZSCORE = {r = 1, t = 'zset', a = 3}, ZCARD = {r = 1, t = 'zset', a = 2},
  DEL = {t = '', a = -2, make = 'none'}, UNLINK = {t = '', a = -2, make = 'none'},
  EXPIRE = {t = '', a = 3, opt = 1, ints = {3}},
  PEXPIRE = {t = '', a = 3, opt = 1, ints = {3}},
  PERSIST = {t = '', a = 2}, EXISTS = {r = 1, t = '', a = -2},
}

local function is_int(s)
  if type(s) ~= 'string' then return false end
  local digits = s:match('^%-?([1-9]%d*)$')
  if not digits then return s == '0' end
  if #digits ~= 19 then return #digits < 19 end
  return digits <= (s:sub(1, 1) == '-' and '9223372036854775808' or '9223372036854775807')
end

local function is_num(s)
  local n = tonumber(s)
  return n ~= nil and n == n and n ~= math.huge and n ~= -math.huge
end

local types, touched = {}, {}
local function type_of(key)
  if types[key] == nil then
    types[key] = redis.call('TYPE', key)['ok']
  end
  return types[key]
end

local function check(cmd)
  if type(cmd) ~= 'table' or type(cmd[1]) ~= 'string' then
    return 'not a list of strings'
  end
  local spec = SPEC[string.upper(cmd[1])]
  if not spec or (spec.opt and #cmd > spec.a) then return nil end
  if (spec.a > 0 and #cmd ~= spec.a) or (spec.a < 0 and #cmd < -spec.a) then
    return 'wrong number of arguments'
  end
  if spec.pairs and (#cmd - 2) % 2 ~= 0 then
    return 'wrong number of arguments (field/value pairs)'
  end
  for _, i in ipairs(spec.ints or {}) do
    if not is_int(cmd[i]) then return 'argument ' .. (i - 1) .. ' is not an integer' end
  end
  for _, i in ipairs(spec.nums or {}) do
    if not is_num(cmd[i]) then return 'argument ' .. (i - 1) .. ' is not a number' end
  end
  local last_key = spec.a < 0 and spec.make == 'none' and #cmd or 2
  for k = 2, last_key do
    local key = cmd[k]
    local now = type_of(key)
    if spec.t ~= '' and now ~= 'none' and now ~= spec.t then
      return 'the key holds a ' .. now .. ', not a ' .. spec.t
    end
    if spec.incr and not touched[key] and now ~= 'none' then
      local value
      if spec.incr == 's' or spec.incr == 'sf' then
        value = redis.call('GET', key)
      else
        value = redis.call('HGET', key, cmd[3])
      end
      local ok = not value or ((spec.incr == 's' or spec.incr == 'h') and is_int(value))
        or ((spec.incr == 'sf' or spec.incr == 'hf') and is_num(value))
      if not ok then return 'the current value is not a number' end
    end
    local make = spec.make or spec.t
    if not spec.r and make ~= '' and not (string.upper(cmd[1]) == 'SETNX' and now ~= 'none') then
      types[key] = make
    end
    -- After a write the value is unknown, except after an integer increment (still one).
    if not spec.r and spec.incr ~= 's' and spec.incr ~= 'h' then
      touched[key] = true
    end
  end
  return nil
end

for i, cmd in ipairs(commands) do
  local reason = check(cmd)
  if reason then
    return {3, i, reason}
  end
end

-- Second pass: advance the fence, forget the answers kept for an older one, then write.
if last ~= fence then
  redis.call('SET', KEYS[1], fence)
end
if not current then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], 'fence', fence)
end
local out = {1, fence}
for i, cmd in ipairs(commands) do
  local ok, reply = pcall(redis.call, unpack(cmd))
  if not ok then
    local reason = type(reply) == 'table' and reply.err or tostring(reply)
    out = {5, fence, i, reason, unpack(out, 3)}
    break
  end
  if type(reply) == 'table' and reply.ok then reply = reply.ok end
  out[#out + 1] = reply
end
local answer = {digest, unpack(out, 1)}
table.remove(answer, 3)  -- the fence is not stored: a replay answers with the current one
redis.call('HSET', KEYS[2], wid, cmsgpack.pack(answer))
if job and out[1] == 1 then
  redis.call('HSET', KEYS[3], 'fingerprint', ARGV[4], 'result', ARGV[5], 'fence', fence)
  if tonumber(ARGV[6]) > 0 then redis.call('PEXPIRE', KEYS[3], ARGV[6]) end
end
return out
