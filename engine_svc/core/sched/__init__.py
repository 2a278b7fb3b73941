"""The scheduler: which requests run this step, and with how many tokens each."""
