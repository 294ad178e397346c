"""The SLO planner: sizes the prefill and decode pools for TTFT and ITL objectives.

``signals`` (what it reads: a snapshot of the router's own state), ``policy`` (what it
decides: pure, on snapshots with explicit time) and ``loop`` (the asyncio loop in the
router process that applies decisions through the same resize as `pdserve scale`);
``host`` (the router's public side the planner uses: it imports no router module) and
``latency_window`` (the recent TTFT and inter-token samples the router records).
Turned on by `pdserve serve --autoscale` (RouterConfig.autoscale).
"""
