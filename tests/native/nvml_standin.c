/* Stand-in libnvidia-ml.so.1 for hosts without an NVIDIA driver: the
 * exported functions pynvml calls, with NVML's public prototypes and types
 * (nvml.h), answering from a text file the test writes and rewrites. Every
 * call reads the file again, so a changed value shows at the next poll.
 *
 * $MMTRACE_NVML_STATE names the file; no file: nvmlInitWithFlags returns
 * NVML_ERROR_DRIVER_NOT_LOADED, as NVML does without its kernel module.
 * One device per line, whitespace separated:
 *   bus_id name sm% membw% mem_total mem_used temp_C power_mW tx_KBps rx_KBps
 *   pcie_gen pcie_width switch numa nvlink_peers
 * nvlink_peers: comma-separated ordinals, or "-". Two devices behind the
 * same switch have NVML_TOPOLOGY_SINGLE as common ancestor, on the same
 * NUMA node NVML_TOPOLOGY_NODE, else NVML_TOPOLOGY_SYSTEM. Link k of a
 * device is active and leads to its k-th peer; further links are
 * NVML_ERROR_NOT_SUPPORTED. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum nvmlReturn_enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_UNKNOWN = 999
} nvmlReturn_t;

typedef struct nvmlDevice_st *nvmlDevice_t;

#define NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE 32
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE 16

typedef struct nvmlPciInfo_st {
    char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
} nvmlPciInfo_t;

typedef struct nvmlUtilization_st {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct nvmlMemory_st {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef enum nvmlTemperatureSensors_enum { NVML_TEMPERATURE_GPU = 0 } nvmlTemperatureSensors_t;
typedef enum nvmlPcieUtilCounter_enum {
    NVML_PCIE_UTIL_TX_BYTES = 0,
    NVML_PCIE_UTIL_RX_BYTES = 1
} nvmlPcieUtilCounter_t;
typedef enum nvmlGpuLevel_enum {
    NVML_TOPOLOGY_INTERNAL = 0,
    NVML_TOPOLOGY_SINGLE = 10,
    NVML_TOPOLOGY_MULTIPLE = 20,
    NVML_TOPOLOGY_HOSTBRIDGE = 30,
    NVML_TOPOLOGY_NODE = 40,
    NVML_TOPOLOGY_SYSTEM = 50
} nvmlGpuTopologyLevel_t;
typedef enum nvmlEnableState_enum {
    NVML_FEATURE_DISABLED = 0,
    NVML_FEATURE_ENABLED = 1
} nvmlEnableState_t;

#define MAX_DEVICES 16
#define MAX_PEERS 16

struct nvmlDevice_st {
    char bus_id[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    char name[64];
    unsigned int sm, membw, temp, power_mw, tx, rx, gen, width, sw, numa;
    unsigned long long total, used;
    int peers[MAX_PEERS];
    int npeers;
};

static struct nvmlDevice_st devices[MAX_DEVICES];
static unsigned int ndevices;
static int initialised;

/* Read the state file again; the handles stay the same array slots. */
static nvmlReturn_t load(void)
{
    const char *path = getenv("MMTRACE_NVML_STATE");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    char peers[256];
    unsigned int n = 0;
    while (n < MAX_DEVICES) {
        struct nvmlDevice_st *d = &devices[n];
        int got = fscanf(f, "%31s %63s %u %u %llu %llu %u %u %u %u %u %u %u %u %255s", d->bus_id,
                         d->name, &d->sm, &d->membw, &d->total, &d->used, &d->temp,
                         &d->power_mw, &d->tx, &d->rx, &d->gen, &d->width, &d->sw, &d->numa,
                         peers);
        if (got != 15)
            break;
        d->npeers = 0;
        for (char *tok = strtok(peers, ","); tok && d->npeers < MAX_PEERS;
             tok = strtok(NULL, ","))
            if (strcmp(tok, "-") != 0)
                d->peers[d->npeers++] = atoi(tok);
        n++;
    }
    fclose(f);
    ndevices = n;
    return NVML_SUCCESS;
}

static nvmlReturn_t device(nvmlDevice_t dev)
{
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t rc = load();
    if (rc != NVML_SUCCESS)
        return rc;
    if (dev < devices || dev >= devices + ndevices)
        return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    nvmlReturn_t rc = load();
    if (rc == NVML_SUCCESS)
        initialised = 1;
    return rc;
}

nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

nvmlReturn_t nvmlShutdown(void)
{
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    initialised = 0;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    if (length < 8)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(version, length, "standin");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t rc = load();
    if (rc == NVML_SUCCESS)
        *deviceCount = ndevices;
    return rc;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *dev)
{
    nvmlReturn_t rc = device(devices);
    if (rc != NVML_SUCCESS && rc != NVML_ERROR_INVALID_ARGUMENT)
        return rc;
    if (index >= ndevices)
        return NVML_ERROR_INVALID_ARGUMENT;
    *dev = &devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t dev, char *name, unsigned int length)
{
    nvmlReturn_t rc = device(dev);
    if (rc == NVML_SUCCESS)
        snprintf(name, length, "%s", dev->name);
    return rc;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t dev, nvmlPciInfo_t *pci)
{
    nvmlReturn_t rc = device(dev);
    if (rc != NVML_SUCCESS)
        return rc;
    memset(pci, 0, sizeof(*pci));
    snprintf(pci->busId, sizeof(pci->busId), "%s", dev->bus_id);
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%.15s", dev->bus_id);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t dev, nvmlUtilization_t *utilization)
{
    nvmlReturn_t rc = device(dev);
    if (rc == NVML_SUCCESS) {
        utilization->gpu = dev->sm;
        utilization->memory = dev->membw;
    }
    return rc;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *memory)
{
    nvmlReturn_t rc = device(dev);
    if (rc == NVML_SUCCESS) {
        memory->total = dev->total;
        memory->used = dev->used;
        memory->free = dev->total - dev->used;
    }
    return rc;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t dev, nvmlTemperatureSensors_t sensorType,
                                      unsigned int *temp)
{
    nvmlReturn_t rc = device(dev);
    if (rc != NVML_SUCCESS)
        return rc;
    if (sensorType != NVML_TEMPERATURE_GPU)
        return NVML_ERROR_INVALID_ARGUMENT;
    *temp = dev->temp;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t dev, unsigned int *power)
{
    nvmlReturn_t rc = device(dev);
    if (rc == NVML_SUCCESS)
        *power = dev->power_mw;
    return rc;
}

nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t dev, nvmlPcieUtilCounter_t counter,
                                         unsigned int *value)
{
    nvmlReturn_t rc = device(dev);
    if (rc != NVML_SUCCESS)
        return rc;
    if (counter == NVML_PCIE_UTIL_TX_BYTES)
        *value = dev->tx;
    else if (counter == NVML_PCIE_UTIL_RX_BYTES)
        *value = dev->rx;
    else
        return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t dev, unsigned int *currLinkGen)
{
    nvmlReturn_t rc = device(dev);
    if (rc == NVML_SUCCESS)
        *currLinkGen = dev->gen;
    return rc;
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t dev, unsigned int *currLinkWidth)
{
    nvmlReturn_t rc = device(dev);
    if (rc == NVML_SUCCESS)
        *currLinkWidth = dev->width;
    return rc;
}

nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                 nvmlGpuTopologyLevel_t *pathInfo)
{
    nvmlReturn_t rc = device(device1);
    if (rc == NVML_SUCCESS)
        rc = device(device2);
    if (rc != NVML_SUCCESS)
        return rc;
    if (device1 == device2)
        *pathInfo = NVML_TOPOLOGY_INTERNAL;
    else if (device1->sw == device2->sw)
        *pathInfo = NVML_TOPOLOGY_SINGLE;
    else if (device1->numa == device2->numa)
        *pathInfo = NVML_TOPOLOGY_NODE;
    else
        *pathInfo = NVML_TOPOLOGY_SYSTEM;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t dev, unsigned int link,
                                      nvmlEnableState_t *isActive)
{
    nvmlReturn_t rc = device(dev);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((int)link >= dev->npeers)
        return NVML_ERROR_NOT_SUPPORTED;
    *isActive = NVML_FEATURE_ENABLED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t dev, unsigned int link,
                                                 nvmlPciInfo_t *pci)
{
    nvmlReturn_t rc = device(dev);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((int)link >= dev->npeers || dev->peers[link] < 0 ||
        (unsigned int)dev->peers[link] >= ndevices)
        return NVML_ERROR_NOT_SUPPORTED;
    memset(pci, 0, sizeof(*pci));
    snprintf(pci->busId, sizeof(pci->busId), "%s", devices[dev->peers[link]].bus_id);
    return NVML_SUCCESS;
}
