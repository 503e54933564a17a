"""The work queue's Lua scripts: each one round trip, and atomic.

Atomic, so two engines never claim the same idle entry and the delivery counts
they report are exact (work_queue.py has the Python side).
"""

# KEYS: the streams, highest priority first, then (when ARGV[6] == "1") the
# queued-tokens counter, then the pullers' sorted set. ARGV: group, consumer,
# max_items, claim_idle_ms, max_deliveries, has_counter, tokens field, live_ms (an
# engine that pulled within it is live), the number of consumers pulling side by side
# as one group (0 alone), and their names.
# Returns {entries, lost, newest}: entries as {stream index, id, fields, times
# delivered, reclaimed}; lost: {stream index, id} of entries deleted while still
# pending (Redis 6.2 keeps them in the PEL and XCLAIM answers nil: acked here so
# they do not come back forever); newest: the newest id of each stream, only
# when nothing was found, for the blocking wake-up read.
PULL_LUA = """
local group, consumer, idle = ARGV[1], ARGV[2], tonumber(ARGV[4])
local room, max_deliveries = tonumber(ARGV[3]), tonumber(ARGV[5])
local pullers = KEYS[#KEYS]
local nstreams = #KEYS - 1
local counter = nil
if ARGV[6] == '1' then
  counter = KEYS[nstreams]
  nstreams = nstreams - 1
end
local tokens_field = ARGV[7]
local entries, lost = {}, {}
local exhausted = 0  -- reclaimed here past max_deliveries: errors to send, not work

for i = 1, nstreams do
  if room <= 0 then break end
  local idle_entries = redis.call('XPENDING', KEYS[i], group, 'IDLE', idle, '-', '+', room)
  for _, p in ipairs(idle_entries) do
    local claimed = redis.call('XCLAIM', KEYS[i], group, consumer, idle, p[1])
    local entry = claimed[1]
    if entry then
      local times = p[4] + 1
      entries[#entries + 1] = {i, entry[1], entry[2], times, 1}
      -- Exhausted entries are reported, not worked on: they take no room.
      if times <= max_deliveries then room = room - 1 else exhausted = exhausted + 1 end
    else
      redis.call('XACK', KEYS[i], group, p[1])
      lost[#lost + 1] = {i, p[1]}
    end
  end
end

-- Consumers pulling side by side even out what they hold: this one takes at most its
-- share of their entries and the new ones, less what it holds (at least one). They are
-- the engines of this queue that pulled within live_ms (other replicas' ranks among
-- them), and this one's data-parallel group's ranks (ARGV[10..]), live or not yet: a
-- group's steps go at its slowest rank's pace. The first to read took a whole burst:
-- of two decoders one ran 11 sequences, the other one; of two groups' four ranks, two
-- ran 8 each and two none. A stream holds only pending and undelivered entries (acked
-- ones are deleted): its new ones are its length less its pending count.
local live_ms, peers = tonumber(ARGV[8]), tonumber(ARGV[9])
local in_group = {}
local now = nil
if live_ms > 0 then
  -- Every pull notes its time, a group's ranks' too (a consumer group's own idle times
  -- move only when entries are delivered: an idle engine would read as gone), at most
  -- every live_ms / 2 (each note is a write, to the append-only file and replicas).
  -- pcall: a Redis at its maxmemory refuses the ZADD, and the pull goes on without it.
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local noted = tonumber(redis.call('ZSCORE', pullers, consumer))
  if not noted or now - noted >= live_ms / 2 then
    redis.pcall('ZADD', pullers, now, consumer)
    redis.pcall('ZREMRANGEBYSCORE', pullers, '-inf', now - 10 * live_ms)
  end
end
in_group[consumer] = true
for j = 10, 9 + peers do in_group[ARGV[j]] = true end
peers = math.max(peers, 1)
if now then
  -- A note lags the last pull by up to live_ms / 2: live is noted within 1.5 live_ms.
  local since = now - math.floor(live_ms * 3 / 2)
  for _, name in ipairs(redis.call('ZRANGEBYSCORE', pullers, since, '+inf')) do
    if not in_group[name] then in_group[name], peers = true, peers + 1 end
  end
end
if peers > 1 and room > 0 then
  local new, held = 0, {}
  for name in pairs(in_group) do held[name] = 0 end
  for i = 1, nstreams do
    local summary = redis.call('XPENDING', KEYS[i], group)
    new = new + math.max(redis.call('XLEN', KEYS[i]) - summary[1], 0)
    for _, c in ipairs(summary[4] or {}) do
      if held[c[1]] then held[c[1]] = held[c[1]] + tonumber(c[2]) end
    end
  end
  held[consumer] = held[consumer] - exhausted
  -- The level the new entries fill the least-holding ones up to (one that holds more
  -- than its share takes none of them, and the rest share them):
  -- of h1 <= h2 <= ..., the first k for which (new + h1 + ... + hk) / k <= h(k+1).
  local counts = {}
  for _, n in pairs(held) do counts[#counts + 1] = n end
  table.sort(counts)
  local sum, level = 0, 0
  for k = 1, #counts do
    sum = sum + counts[k]
    level = (new + sum) / k
    if k == #counts or level <= counts[k + 1] then break end
  end
  room = math.min(room, math.max(math.ceil(level) - held[consumer], 1))
end

local tokens = 0
for i = 1, nstreams do
  if room <= 0 then break end
  local got = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', room,
                         'STREAMS', KEYS[i], '>')
  if got then
    for _, entry in ipairs(got[1][2]) do
      entries[#entries + 1] = {i, entry[1], entry[2], 1, 0}
      room = room - 1
      local f = entry[2]
      for j = 1, #f, 2 do
        local n = f[j] == tokens_field and tonumber(f[j + 1])
        if n and n > 0 then tokens = tokens + math.floor(n) end
      end
    end
  end
end
if counter and tokens > 0 then
  if redis.call('DECRBY', counter, tokens) < 0 then redis.call('SET', counter, 0) end
end

local newest = {}
if #entries == 0 and #lost == 0 then
  for i = 1, nstreams do
    local last = redis.call('XREVRANGE', KEYS[i], '+', '-', 'COUNT', 1)
    newest[i] = last[1] and last[1][1] or '0-0'
  end
end
return {entries, lost, newest}
"""

# Refresh the idle time of entries this consumer still owns. Returns {taken, gone}:
# taken by another consumer meanwhile (left alone: XCLAIM with min-idle 0 would steal
# it back and both engines would serve it), or pending nowhere (another engine
# finished it, or Redis lost it). Without the group (Redis lost its data) nobody
# else can take the entries: none is either.
# KEYS[1]: stream. ARGV: group, consumer, ids...
KEEP_ALIVE_LUA = """
local taken, gone = {}, {}
if redis.pcall('XPENDING', KEYS[1], ARGV[1]).err then return {taken, gone} end
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if not p[1] then
    gone[#gone + 1] = ARGV[i]
  elseif p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    taken[#taken + 1] = ARGV[i]
  end
end
return {taken, gone}
"""

# Hand entries this consumer owns back to the group: idle long enough for any
# engine's next pull to reclaim them, which counts a delivery. ARGV[4] == '1' counts
# the delivery that ends here down by one (a drain that timed out: a shutdown is no
# failure, so it must not bring a request nearer max_deliveries; JUSTID alone leaves
# the count as is). '0' keeps it (a dead predecessor's entries: it may have died of
# the request, and max_deliveries must stop one that kills every engine).
# KEYS[1]: stream. ARGV: group, consumer, idle ms, count down, ids... Returns how many.
HAND_BACK_LUA = """
local n = 0
if redis.pcall('XPENDING', KEYS[1], ARGV[1]).err then return n end
for i = 5, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    local times = p[1][4]
    if ARGV[4] == '1' then times = math.max(times - 1, 0) end
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3],
               'RETRYCOUNT', times, 'JUSTID')
    n = n + 1
  end
end
return n
"""
# Publish a Handoff and acknowledge (delete) the work entry it was prefilled from, at once:
# a crash can no longer fall between the two (the entry reclaimed and handed off again),
# nor can a retry after a lost reply publish it twice (the marker says it was), nor an
# engine that stalled publish an entry another engine took over meanwhile. An entry
# Redis lost (restarted without its data) is published: nobody else holds it.
# KEYS: the work stream, the handoff stream of its priority, the request's published
# marker, the normal priority's handoff stream. The priority's stream is used only once a
# decoder made it (every decoder makes all three as it starts); until then (decoders of a
# version with one handoff stream, through a rolling upgrade) the normal one, which every
# version's decoders read: a high request is then not first, but never unread. (The
# caller passes the normal stream as both where a live decoder reads it alone: after a
# rolled-back upgrade the streams made stay.)
# ARGV: group, consumer, work entry id, marker TTL in seconds, the handoff's fields.
# Returns 1 when published, 2 when this consumer had published it already (a retry:
# its KV stays offered), 0 when another engine has the request.
PUBLISH_HANDOFF_LUA = """
local marker = ARGV[3] .. ' ' .. ARGV[2]
local published = redis.call('GET', KEYS[3])
if published == marker then return 2 end
if published and string.sub(published, 1, #ARGV[3] + 1) == ARGV[3] .. ' ' then return 0 end
local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if not p.err and p[1] and p[1][2] ~= ARGV[2] then return 0 end
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
local target = KEYS[2]
if redis.call('EXISTS', target) == 0 then target = KEYS[4] end
redis.call('XADD', target, '*', unpack(fields))
redis.call('SET', KEYS[3], marker, 'EX', ARGV[4])
redis.pcall('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.pcall('XDEL', KEYS[1], ARGV[3])
return 1
"""

# Idle time given to a handed-back entry: longer than any engine's --claim-idle-ms.
HANDED_BACK_IDLE_MS = 24 * 3600 * 1000

# Delete the group's consumers that hold nothing pending and have been idle at least
# ARGV[2] ms, and ARGV[3] (this engine, leaving) whatever its idle time, if it holds
# nothing. Each engine id adds a consumer, and pods come and go under new ids: without
# this the groups list every engine that ever ran. Harmless to a live engine: its next
# read recreates it, and one with entries pending is never deleted (DELCONSUMER would
# drop them from the pending list, and so from every reclaim).
# KEYS: the streams. ARGV: group, min idle ms, leaving consumer or ''. Returns how many.
FORGET_CONSUMERS_LUA = """
local n = 0
for i = 1, #KEYS do
  local consumers = redis.pcall('XINFO', 'CONSUMERS', KEYS[i], ARGV[1])
  if not consumers.err then
    for _, flat in ipairs(consumers) do
      local c = {}
      for j = 1, #flat, 2 do c[flat[j]] = flat[j + 1] end
      local quiet = c['name'] == ARGV[3] or c['idle'] >= tonumber(ARGV[2])
      if c['pending'] == 0 and quiet then
        redis.call('XGROUP', 'DELCONSUMER', KEYS[i], ARGV[1], c['name'])
        n = n + 1
      end
    end
  end
end
return n
"""
