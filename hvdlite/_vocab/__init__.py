"""The shared vocabulary, below every plane that uses it: messages (``Kind``, ``SPECS``,
``Request``, ``Response``), entries, plans (lanes, calls, member plans) and fusion buffers."""
