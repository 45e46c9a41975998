"""The ground floor: errors, config-field helpers, logging, measurement and report helpers.

Every other package may import from here; nothing here imports any other package of the
project (tests/test_layering.py holds that line).
"""
