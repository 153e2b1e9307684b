"""The Lua scripts that make each control step atomic in Redis.

A request is recorded in the run's request stream and published in one script, so it
is durable before any worker hears of it. A worker's writes (events, status, lease)
check that the run is still its own, so a worker that lost its run to a claim cannot
write into it. Event batches carry client-side numbers, so a batch re-sent after an
ambiguous failure is appended once.

Run hash fields: status, worker, name, attempt, created_at, started_at, ended_at,
reason, error, info (JSON), seq (events appended), pub (last batch number of this
attempt), requests_seen (the last request the worker applied).
"""

from __future__ import annotations

__all__ = ["CLAIM", "PUBLISH", "REGISTER", "RENEW", "REQUEST", "RESERVE"]

#: How many of the oldest listed runs each registration checks, dropping those whose
#: record expired: the runs list stays bounded without anyone calling runs().
PRUNE = 32

#: KEYS run, lease, runs, requests; ARGV worker, lease_ms, now, name, info, run_id, fresh,
#: run key prefix, PRUNE. -> {'ok', requests_seen, pending requests} | {'busy', holder}
#: | {'finished', status}
REGISTER = """
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] then return {'busy', holder} end
local status = redis.call('HGET', KEYS[1], 'status')
if status and status ~= 'pending' and status ~= 'running' then return {'finished', status} end
local owner = redis.call('HGET', KEYS[1], 'worker')
if owner and owner ~= ARGV[1] then return {'busy', owner} end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
if ARGV[7] == '1' then
  redis.call('HINCRBY', KEYS[1], 'attempt', 1)
  redis.call('HSET', KEYS[1], 'pub', 0, 'started_at', ARGV[3], 'name', ARGV[4])
  if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'info', ARGV[5]) end
else
  redis.call('HSETNX', KEYS[1], 'pub', 0)
  redis.call('HSETNX', KEYS[1], 'started_at', ARGV[3])
  redis.call('HSETNX', KEYS[1], 'name', ARGV[4])
  redis.call('HSETNX', KEYS[1], 'attempt', 1)
  if ARGV[5] ~= '' then redis.call('HSETNX', KEYS[1], 'info', ARGV[5]) end
end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1])
redis.call('HSETNX', KEYS[1], 'created_at', ARGV[3])
redis.call('PERSIST', KEYS[1])
redis.call('PERSIST', KEYS[4])
redis.call('ZADD', KEYS[3], 'NX', ARGV[3], ARGV[6])
for _, old in ipairs(redis.call('ZRANGE', KEYS[3], 0, tonumber(ARGV[9]) - 1)) do
  if redis.call('EXISTS', ARGV[8] .. old) == 0 then redis.call('ZREM', KEYS[3], old) end
end
local seen = redis.call('HGET', KEYS[1], 'requests_seen') or '0-0'
return {'ok', seen, redis.call('XRANGE', KEYS[4], '(' .. seen, '+')}
"""

#: KEYS run, events, lease, requests; ARGV worker, maxlen, final status ('' while
#: running), reason, error, ended_at, retention_s, requests_seen (''), then triples
#: (batch number, type, JSON). -> last batch number appended; -1: not this worker's run;
#: -2: the record is gone (Redis restarted empty, or it was deleted): register again.
PUBLISH = """
local owner = redis.call('HGET', KEYS[1], 'worker')
if not owner then return -2 end
if owner ~= ARGV[1] then return -1 end
local status = redis.call('HGET', KEYS[1], 'status')
local pub = tonumber(redis.call('HGET', KEYS[1], 'pub') or '0')
if status ~= 'running' then
  if status == 'pending' then return -1 end
  return pub
end
local i = 9
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  if n > pub then
    local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*',
               'seq', seq, 'type', ARGV[i + 1], 'data', ARGV[i + 2])
    pub = n
  end
  i = i + 3
end
redis.call('HSET', KEYS[1], 'pub', pub)
if ARGV[8] ~= '' then redis.call('HSET', KEYS[1], 'requests_seen', ARGV[8]) end
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'status', ARGV[3], 'reason', ARGV[4], 'error', ARGV[5],
             'ended_at', ARGV[6])
  redis.call('DEL', KEYS[3])
  redis.call('EXPIRE', KEYS[1], ARGV[7])
  redis.call('EXPIRE', KEYS[2], ARGV[7])
  redis.call('EXPIRE', KEYS[4], ARGV[7])
end
return pub
"""

#: KEYS run, lease, requests; ARGV worker, lease_ms, requests cursor.
#: -> {1, requests after the cursor} | {0}: not ours any more | {2}: the record is gone
#: | {3}: it has ended (its end was written while this renewal was on its way).
RENEW = """
local owner = redis.call('HGET', KEYS[1], 'worker')
if not owner then return {2} end
if owner ~= ARGV[1] then return {0} end
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return {3} end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] then return {0} end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return {1, redis.call('XRANGE', KEYS[3], '(' .. ARGV[3], '+')}
"""

#: KEYS run, lease; ARGV claimer, lease_ms.
#: -> {'ok'} | {'unknown'} | {'not_lost', status} | {'alive', holder}
CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown'} end
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'running' then return {'not_lost', status} end
local holder = redis.call('GET', KEYS[2])
if holder then return {'alive', holder} end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
redis.call('HSET', KEYS[1], 'worker', ARGV[1])
return {'ok'}
"""

#: KEYS run, requests; ARGV kind, JSON data, channel base, run_id.
#: -> {'ok', request id} | {'unknown'} | {'finished', status}
REQUEST = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown'} end
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'pending' and status ~= 'running' then return {'finished', status} end
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', 1000, '*', 'kind', ARGV[1], 'data', ARGV[2])
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
local worker = redis.call('HGET', KEYS[1], 'worker')
if worker then
  redis.call('PUBLISH', ARGV[3] .. worker,
             cjson.encode({run = ARGV[4], id = id, kind = ARGV[1], data = ARGV[2]}))
end
return {'ok', id}
"""

#: KEYS run, runs; ARGV now, info, ttl_s, run_id. -> 1, or 0 if the id exists.
RESERVE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'status', 'pending', 'created_at', ARGV[1], 'attempt', 0)
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'info', ARGV[2]) end
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[4])
return 1
"""
