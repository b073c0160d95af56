"""Pure rules: retry policy, limit keys and windows, fair shares, prices, schedule ticks.

No database access and no state writes: `transitions/`, the public calls and the checks all
decide with these, so they sit below `transitions/` in the import direction.
"""
