"""Stand-ins for devices polca talks to: real servers run as processes by the tests."""
