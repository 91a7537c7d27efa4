"""The L3 tier policy: lookup after L2, prefetch and claim, write-back, rank groups."""
