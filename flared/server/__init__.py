"""The daemon's socket side: listener, sessions, delivery of engine events to clients."""
