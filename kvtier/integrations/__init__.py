"""Adapters to serving engines: the only place in kvtier that imports them.

Each adapter translates its engine's types into kvtier's own at this edge;
``kvtier/`` outside this package never imports a serving engine (a test
asserts it).
"""
