"""The benchmarks behind ``superneurons bench ...``, a folder per benchmark.

* :mod:`.codecs`: codec error, bits and speed on real gradients at equal bit budgets, and codec
  throughput on one device (``bench codecs``);
* :mod:`.network`: step time per codec over shaped links (``bench network``);
* :mod:`.convergence`: final accuracy per codec against dense DDP (``bench convergence``);
* :mod:`.memory`: peak memory and step time of our plans against the anchors (``bench memory``)
  and the deepest ResNet per strategy on fake tensors (``bench deeper``);
* :mod:`.links`: what the network benchmarks share: namespaces joined by shaped veth links, and
  the bytes each rank's interface moved;
* :mod:`.artifacts`: what every benchmark writes (JSON naming machine, versions and command;
  Markdown; PNG).
"""
