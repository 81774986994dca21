-- rate_take.lua: one GCRA step of a fleet-wide rate limiter (locks/ratelimit.py), on TIME.
-- KEYS[1] the limiter's key: its theoretical arrival time (tat), µs since the epoch
-- ARGV[1] interval µs (period / count)  ARGV[2] burst (>= 1)
-- ARGV[3] max wait µs: admit (reserving the turn) if it comes within it; negative: only look
-- Returns {1, wait_us, now_us}   admitted: act after wait_us (0: at once)
--         {0, wait_us, now_us}   refused: one would be admitted at once after wait_us
-- Numbers go back as strings: Lua numbers are doubles, Redis would truncate them.
-- The key expires when its tat passes: an absent key and a past tat mean the same (idle).
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local tau = (tonumber(ARGV[2]) - 1) * interval
local max_wait = tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
local start = tat
if start < now then start = now end
local wait = start - tau - now
if wait < 0 then wait = 0 end
if max_wait < 0 or wait > max_wait then
  return {0, string.format('%.0f', wait), string.format('%.0f', now)}
end
local new = start + interval
redis.call('SET', KEYS[1], string.format('%.0f', new), 'PX', math.ceil((new - now) / 1000) + 1)
return {1, string.format('%.0f', wait), string.format('%.0f', now)}
