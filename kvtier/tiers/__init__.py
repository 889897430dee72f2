"""Storage tiers below the CPU region: the O_DIRECT file tier."""
