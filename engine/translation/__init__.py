"""A mergekit config as a method module reads it: the inputs, base and places its parameters
are set (config.py), each parameter resolved as mergekit resolves it (settings.py), and what a
method declares of its mergekit counterpart, with the translators methods share
(translators.py). Below methods/, so that each method module carries its own translation;
engine/mergekit/ reads a config into these and picks the method. Imports nothing of the engine
but its errors."""
