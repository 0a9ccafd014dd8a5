"""Frontend processes (`--frontend-processes N`): the public doors out of the scheduler loop's
process, so that client I/O (gRPC and HTTP streaming, request intake) never runs on its thread.

    clients ──▶ frontend 0 ─┐ socketpair   ┌──────────── engine core ──────────────┐
    (one port, ──▶ frontend 1 ─┼────────────▶│ hub ─▶ EngineLoop / ReplicaSet ─▶ model │
     SO_REUSEPORT)   ...    ─┘  one message │ /metrics, KV events, detokenize, stops │
                                per step    └────────────────────────────────────────┘

Messages on a link (frontends/link.py frames them), core -> frontend:
  ("hello", index, config, facts, lora registry, grpc port, http port, status)
  ("step", [request_id, RequestOutput or token id(s), ...], status)  one per step with outputs
                        for it, flat (an output of token ids only travels as its id or ids)
  ("status", status)                                     while no step goes out
  ("refused", request_id, Rejected)                      an add over the queue's bounds, or a
                                                         duplicate id: the door's refusal
  ("loras", LoraRegistry, version)                       after a run-time load or unload
  ("reply", call_id, result)                             a call's answer
  ("stop", grace_s)                                      close the doors and exit
frontend -> core:
  ("ready", pid) or ("failed", one line)                 after hello
  ("add", Request)        the request without its sink and guide (Request.__getstate__)
  ("abort", request_id)   ("rejected", reason)           counted in the core's one registry
  ("loras_applied", version)                             the registry is in use (loras.py)
  ("call", call_id, op, args)                            reset_prefix_cache, metrics_text,
                                                         abort, status, barrier,
                                                         lora_load, lora_unload (loras.py)
"""
