# The stand-in base the test images are built on: the python stand-in, plus what pip needs here
# and the production build does not: this machine's CA bundle (TLS to PyPI goes through it) and
# the local folder holding torch's CPU wheel (a torch from PyPI would bring GBs of CUDA). Test
# images carry both (0.18 GB); the production Dockerfile and compose file never name them.
ARG PYTHON_IMAGE=layerswap-test/python:3.11
FROM ${PYTHON_IMAGE}
COPY ca-bundle.crt /etc/layerswap-build/ca-bundle.crt
COPY wheels/ /opt/wheels/
RUN printf '[global]\ncert = /etc/layerswap-build/ca-bundle.crt\nfind-links = /opt/wheels\n' >/etc/pip.conf
