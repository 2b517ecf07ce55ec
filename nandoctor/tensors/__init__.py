"""Tensor and array helpers every layer reads values with: conversion, finiteness, sizes, grouped
reductions, the device. A leaf: it imports nothing of nandoctor but `errors` and `findings`."""
