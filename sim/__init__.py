"""tandem sim: a discrete-event simulator of a Tandem cluster.

The simulated engines run the real step scheduler (tandem.engine.scheduler) and
the cluster is sized by the real autoscaler (tandem.operator.autoscaler); only
the model's arithmetic is replaced, by a roofline cost model of the device. A
change to a scheduling or scaling rule therefore changes the simulated result.

docs/simulator.md describes the design, the calibration and the studies.
"""
