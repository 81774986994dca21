"""The demo, from a checkout: the shop's workflows, the storm, the fleet (not in the wheel)."""
