"""Real, shaped links between ranks: network namespaces joined by veth pairs rate-limited with
tbf, and the link's measured goodput (:mod:`.netns`); the bytes each rank's interface moved
(:mod:`.wire_bytes`). Linux; creating namespaces needs root."""
