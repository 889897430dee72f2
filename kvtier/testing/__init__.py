"""Conformance suites and fault-injecting wrappers shipped with kvtier.

Each contract (residency manager, I/O engine, device transfer) has a suite class
that an implementation's tests subclass, so every implementation runs the same
checks.
"""
