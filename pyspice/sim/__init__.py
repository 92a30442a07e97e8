"""Trace-driven simulation of expert offloading on hardware this machine is not
(docs/design.md section 8): the policies that ship, replayed over recorded routing on
a discrete-event model of a device, its bus and the host. Always labelled
simulated."""
