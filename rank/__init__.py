"""The rank body every worker shares: engine + loop + group + KV endpoint, and the
typed router <-> rank messages (messages.py)."""
