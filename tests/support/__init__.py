"""kvtier's own test harness: child processes, slot-file inspection, odd filesystems.

What implementers of kvtier's contracts use (conformance suites, fault
injection, the Valkey launcher) is :mod:`kvtier.testing`; this package is
kvtier's tests' alone, imported as ``support`` (pytest's ``pythonpath``
puts ``tests/`` on the path).
"""
