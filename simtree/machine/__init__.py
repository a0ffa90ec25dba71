"""The machine a profile or run happened on: recorded facts and a quick host-speed probe."""
