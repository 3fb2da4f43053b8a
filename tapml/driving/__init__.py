"""Driving: the checking work over a target -- replay of carved cases, regions and bisection,
migration with its journal, sessions, generations, precision searches, fleets and repros."""
