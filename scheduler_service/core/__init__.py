"""The scheduling core: requests, the scheduler and its step rule, policies, KV blocks, swap space,
and the plan codec (the one module that knows the engine wire).
"""
