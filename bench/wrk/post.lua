-- wrk script: POST the workload's bodies in turn and print the latency distribution as JSON.
--
-- Bodies come from the file named by NOGRAD_BENCH_BODIES, one JSON body per line, or with
-- NOGRAD_BENCH_HEX=1 one hex-encoded body per line (binary bodies such as PNG images have raw
-- newlines). NOGRAD_BENCH_METHOD (default POST) and NOGRAD_BENCH_CONTENT_TYPE (default
-- application/json) set the request line and its Content-Type. Requests are formatted once per
-- thread in init(), so request() costs a table lookup. done() prints one line
-- "WRK_JSON {...}" that bench/loadgen.py parses: counts, errors (non-2xx = HTTP status >= 400 as
-- wrk counts them, plus socket errors) and the p50/p90/p99/p99.9 latency in microseconds.

local counter = 0
local threads = {}

function setup(thread)
   thread:set("id", counter)
   table.insert(threads, thread)
   counter = counter + 1
end

local requests = {}
local index = 1

function init(args)
   local path = os.getenv("NOGRAD_BENCH_BODIES")
   local file = assert(io.open(path, "rb"), "cannot open bodies file " .. tostring(path))
   local method = os.getenv("NOGRAD_BENCH_METHOD") or "POST"
   local hex = os.getenv("NOGRAD_BENCH_HEX") == "1"
   local headers = { ["Content-Type"] = os.getenv("NOGRAD_BENCH_CONTENT_TYPE") or "application/json" }
   for line in file:lines() do
      if #line > 0 then
         if hex then
            line = line:gsub("%x%x", function(pair) return string.char(tonumber(pair, 16)) end)
         end
         table.insert(requests, wrk.format(method, nil, headers, line))
      end
   end
   file:close()
   assert(#requests > 0, "no bodies in " .. path)
   -- Threads start at different bodies so they do not send the same sequence in lockstep.
   index = ((id or 0) * 97) % #requests + 1
end

local pause = tonumber(os.getenv("NOGRAD_BENCH_PAUSE_MS") or "")
if pause then
   -- wrk looks for a global delay() after loading the script; defined only when pacing.
   function delay()
      return pause
   end
end

function request()
   local req = requests[index]
   index = index + 1
   if index > #requests then
      index = 1
   end
   return req
end

function done(summary, latency, requests_)
   local e = summary.errors
   local parts = {
      string.format('"requests": %d', summary.requests),
      string.format('"duration_us": %d', summary.duration),
      string.format('"bytes": %d', summary.bytes),
      string.format('"errors_status": %d', e.status),
      string.format('"errors_connect": %d', e.connect),
      string.format('"errors_read": %d', e.read),
      string.format('"errors_write": %d', e.write),
      string.format('"errors_timeout": %d', e.timeout),
      string.format('"latency_mean_us": %.1f', latency.mean),
      string.format('"latency_max_us": %d', latency.max),
      string.format('"p50_us": %d', latency:percentile(50)),
      string.format('"p90_us": %d', latency:percentile(90)),
      string.format('"p99_us": %d', latency:percentile(99)),
      string.format('"p999_us": %d', latency:percentile(99.9)),
   }
   io.write("WRK_JSON {" .. table.concat(parts, ", ") .. "}\n")
end
