"""Nexmark benchmark for keyscale (issue 16): the event generator (``generator.py``).

``bench/`` is not a package; the scripts put ``bench/`` on ``sys.path`` and import
``nexmark.generator`` from there, as the tests do.
"""
