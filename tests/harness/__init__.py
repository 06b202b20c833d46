"""Test harness shared by the test tiers: tiny model builder, engine fixtures, test doubles."""
