-- Argo CD health check for kvfleet.io/InferenceDeployment (resource.customizations.health.kvfleet.io_InferenceDeployment).
-- Maps the operator's conditions to Argo CD health; see docs/argocd.md. Lua 5.1 (gopher-lua).
--   status older than metadata.generation  -> Progressing (the operator has not seen the change yet,
--                                             so an old Degraded does not hide a fix being applied)
--   Degraded=True                          -> Degraded (the operator cannot recover on its own)
--   ScaledToZero=True                      -> Healthy (idle by design; the router wakes it on demand)
--   Ready=True                             -> Healthy, even while autoscaling adds replicas, so an
--                                             application does not flap with every scale-up
--   anything else                          -> Progressing, with the operator's reason and message
local hs = {}

local function find(conditions, wanted)
  if conditions == nil then
    return nil
  end
  for _, c in ipairs(conditions) do
    if c.type == wanted then
      return c
    end
  end
  return nil
end

local function explain(c)
  local text = c.reason or ""
  if c.message ~= nil and c.message ~= "" then
    if text ~= "" then
      text = text .. ": " .. c.message
    else
      text = c.message
    end
  end
  return text
end

local status = obj.status
if status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvfleet operator to report status"
  return hs
end

local generation = obj.metadata.generation
if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local conditions = status.conditions
local degraded = find(conditions, "Degraded")
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = explain(degraded)
  return hs
end

local zero = find(conditions, "ScaledToZero")
if zero ~= nil and zero.status == "True" then
  hs.status = "Healthy"
  hs.message = "Scaled to zero; the router wakes it on the next request"
  return hs
end

local ready = find(conditions, "Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = tostring(status.readyReplicas or 0) .. "/" .. tostring(status.desiredReplicas or status.replicas or 0) .. " replicas ready"
  return hs
end

hs.status = "Progressing"
local progressing = find(conditions, "Progressing")
if progressing ~= nil and progressing.status == "True" then
  hs.message = explain(progressing)
elseif ready ~= nil then
  hs.message = explain(ready)
else
  hs.message = "Waiting for the Ready condition"
end
return hs
